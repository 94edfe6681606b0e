from dpadapter.models.factory import (
    MODEL_NAMES,
    create_model,
    get_head_params,
    replace_head,
    with_timm_args,
)

__all__ = ["MODEL_NAMES", "create_model", "get_head_params", "replace_head", "with_timm_args"]
