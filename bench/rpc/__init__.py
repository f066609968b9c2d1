"""Transport benchmarks: a round trip over ZMQ IPC against a local link, the peer lane against ZMQ TCP, and a TP
step's agreement over local links against gloo."""
