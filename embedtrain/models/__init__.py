"""Plain ``nn.Module``s built on TorchRec modules; they know nothing of ranks, files or configs."""

from embedtrain.models.dlrm import dcn, dlrm, embedding_bag_collection

__all__ = ["dcn", "dlrm", "embedding_bag_collection"]
