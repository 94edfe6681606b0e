from dpadapter.models.factory import MODEL_NAMES, create_model, get_head_params, replace_head

__all__ = ["MODEL_NAMES", "create_model", "get_head_params", "replace_head"]
