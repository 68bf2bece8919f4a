"""The cluster store on etcd (``--store etcd://...``): the URL (:mod:`.url`),
the v3 client over gRPC (:mod:`.client`, :mod:`.transport`, :mod:`.watch`,
:mod:`.errors`), what a node accepts of a document (:mod:`.document`), and the
replica that pushes and watches plans (:mod:`.replica`, retrying with
:mod:`.backoff`).
"""
