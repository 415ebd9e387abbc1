"""One identity's fenced state: leases, the commit compare-and-swap, heads, retention, migrations, and the
writer session a task or a pod holds. Built on the content layer; knows nothing of other identities."""
