"""Every backbone, its head and its BatchNorm (layer 1).

`factory` builds a registered model or a timm one and swaps its head; `batchnorm` and `pinned`
freeze or replace BatchNorm, `input_adapter` fits an external backbone's input. The layers
above train these models, so this may import only the ground floor (`ground`, `settings`,
`compat`), never privacy, data or training code.
"""

from dpadapter.models.factory import (
    MODEL_NAMES,
    create_model,
    get_head_params,
    replace_head,
    with_timm_args,
)

__all__ = ["MODEL_NAMES", "create_model", "get_head_params", "replace_head", "with_timm_args"]
