# The Airflow image of `docker compose up` (docker-compose.yaml): the official image plus this provider.
# Only what the install needs is copied (pyproject.toml, README.md, LICENSE and NOTICE, the package), so the
# build context's .venv, .git and caches never reach the image.
FROM apache/airflow:3.3.2

COPY --chown=airflow:root pyproject.toml README.md LICENSE NOTICE /opt/airflow/airflow-provider-stateful/
COPY --chown=airflow:root airflow_stateful /opt/airflow/airflow-provider-stateful/airflow_stateful

# Pin apache-airflow to the image's own version (AIRFLOW_VERSION is set by the official image) so that pip
# cannot upgrade or downgrade Airflow while resolving this package's dependencies.
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" /opt/airflow/airflow-provider-stateful
