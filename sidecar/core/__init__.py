"""The pure decision core, shared by the daemon and the client.

Frozen values in, a decision and the effects to carry out out: no grpc,
asyncio, torch, clock or I/O (time is an argument). ``plan`` holds the
capacity vector and its one join; ``group`` the per-group state; ``policy``
the decisions; ``effects`` what the state holder carries out; ``cluster`` the
merge of plans from other nodes; ``limits``, ``sizing``, ``identity``,
``errors`` and ``defaults`` the ranges, FlashInfer's size arithmetic, ids,
typed errors and the constants both sides share.
"""
