"""The HTTP headers of session affinity, shared by the client side (client/affinity.py) and the replica's
server (serve/http/control_routes.py); a module of its own so that neither pulls the other (or torch) in."""

SESSION_HEADER = "X-Session-ID"  # the router keeps requests with one value on one replica
REPLICA_HEADER = "x-artrl-replica"  # the replica that answered
EXPECTED_HEADER = "x-artrl-replica-expected"  # the replica a rollout's later turn expects
