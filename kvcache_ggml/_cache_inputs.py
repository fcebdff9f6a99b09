"""Input half of KVCache (interim placeholder; filled by the graph issue)."""


class InputMixin:
    """set_input_* of llama_kv_cache."""


class ContextInputsMixin:
    """numpy conveniences of KVCacheContext."""
