"""Getting into pods: the SSH gateway for users, the pooled SSH connections to the agents'
access servers, and the keys the server uses for both (see docs and access/upstream.py)."""
