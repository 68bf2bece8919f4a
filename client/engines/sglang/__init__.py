"""SGLang 0.5.23: its FlashInfer dispatcher's workspaces, sized exactly per namespace.

:mod:`.sizing` (pure: SGLang's own sizes and the exact ones), :mod:`.naming`
(the group of each namespace), :mod:`.backend` (SGLang's namespace padding),
:mod:`.dispatcher` (SGLang's class with its allocation deferred),
:mod:`.workspaces` (sized after load, sealed before graph capture) and
:mod:`.plugin` (the ``sglang.srt.plugins`` entry point). docs/sglang.md says
how to run it. Importing this package imports neither torch nor SGLang.
"""

__all__: list[str] = []
