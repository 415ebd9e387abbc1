"""What StatefulKubernetesPodOperator adds to a pod, as plain functions of Kubernetes client models.

Kept apart from the operator so the operator module reads in one sitting and these pieces (labels, which pod
to reattach to, the state parts of a pod spec) can be tested without building an operator. Needs the
``kubernetes`` extra.
"""
