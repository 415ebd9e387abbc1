"""What StatefulKubernetesPodOperator adds to a pod, mostly as plain functions of Kubernetes client models.

Kept apart from the operator so the operator module reads in one sitting as its own control flow, and these
pieces can be tested without building an operator. One idea a module:

* ``labels``: the labels that find an identity's pods;
* ``reattach``: which of those pods to reattach to (adopting its lease) and which are stale;
* ``pods``: :class:`~airflow_stateful.kubernetes.pods.PodState`, what a pod is told, and its variables;
* ``spec``: the state parts of the pod spec for each ``state_mode``;
* ``lease_secrets``: the Secret that carries the lease token, owned by the pod;
* ``restore_cache`` and ``placement``: the node's restore cache and the soft preference for its node;
* ``results``: what the finished pod's status and the head say about its work.

Needs the ``kubernetes`` extra (the cncf.kubernetes provider, which brings the ``kubernetes`` client).
"""
