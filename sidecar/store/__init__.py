"""What the sidecar keeps: the node's SQLite record (:mod:`.sqlite`), the one
codec of stored rows and cluster documents (:mod:`.row_codec`, with
:mod:`.row_fields` and :mod:`.cluster_plan_codec`), and the interface a
cluster replica implements (:mod:`.replica`; etcd's is :mod:`moe_sidecar.etcd`).
"""
