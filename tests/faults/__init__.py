"""Fault-injection harness (issue 6): attack the guarantees on the real broker and Redis, prove them.

``python -m tests.faults.run --size ci|full --seed N [--bug NAME] --out DIR`` runs its own Kafka and
Redis (own ports, own run dir), a producer, 3 consumers (+1 that joins and leaves) and a seeded
fault schedule; ``python -m tests.faults.checker DIR`` reads the logs and prints one PASS/FAIL line
per guarantee. See tests/faults/README.md.
"""
