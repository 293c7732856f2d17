"""Speculative decoding: proposers, the choice of K per step, and the engine's hook.

A proposer reads a decoding request's tokens (and, for a draft model, runs one) and proposes up
to K next tokens; the scheduler schedules the request for 1 + K tokens, the runner scores them
in one step and its sampler accepts a prefix of the drafts (exactly for greedy requests, by
rejection sampling for random ones), and the scheduler rolls back the rest. Proposers:
`ngram` (prompt lookup), `suffix` (the request and recent outputs under its cache salt) and
`draft` (a smaller checkpoint). `policy` decides K per request and step.
"""
