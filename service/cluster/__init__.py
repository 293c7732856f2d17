"""The service past one machine: engine replicas on Ray Serve behind one ingress.

`stillcut serve --replicas N` deploys N replicas, each a whole stillcut server (model, engine,
encoder and prefix caches), and one ingress running the same app, whose endpoints forward.
The ingress reads each request under the service's limits and keys it by its first medium
(`affinity`); Ray Serve's request router, ours, sends a key to the replica rendezvous hashing
picks unless that replica is busier than the least-loaded by a margin (`router`), so repeated
questions about one video meet its caches. Needs the `cluster` extra (`ray[serve]`); nothing
here is imported by a single-process server.
"""
