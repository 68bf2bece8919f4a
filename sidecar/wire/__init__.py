"""What crosses a process boundary, used by the daemon and the client alike.

``codec`` converts between the core's values and the gRPC messages (one
codec for the wire), ``address`` parses the address forms of a sidecar, and
``display`` renders groups for an operator.
"""
