"""Model loading and the forward runner (the only code that knows the model library)."""

from vericache.model.kvcache import KVCache
from vericache.model.loader import LoadedModel, load_model, resolve_model_path
from vericache.model.runner import Runner, SeqBatchItem

__all__ = ["KVCache", "LoadedModel", "Runner", "SeqBatchItem", "load_model", "resolve_model_path"]
