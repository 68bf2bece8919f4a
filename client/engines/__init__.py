"""The engines' rooms: one folder per inference engine the client serves.

Each room (``vllm/`` today) holds everything about its engine: the drop-in
surface its callers read, built on the engine-neutral manager
(:class:`moe_sidecar.client.manager.AlltoAllManager`), its plugin and entry
point, its sizing rules (its ``initialize()`` arguments as a
:class:`~moe_sidecar.client.layer_need.LayerNeed`), its group naming and the
environment it reads. A room imports the manager; nothing outside the rooms
imports a room (``tests/unit/test_import_graph.py``), except the package
face's lazy ``moe_sidecar.client.WorkspaceManager``. The next engine is a
sibling folder (``docs/development.md``, "Add an engine").
"""
