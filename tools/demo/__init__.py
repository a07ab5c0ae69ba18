"""`fabric demo`: a trainer and rollout workers exchanging real weights over the fabric."""
