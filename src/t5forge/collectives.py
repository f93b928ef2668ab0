"""torch.distributed's flat-tensor collectives under the running torch's names: 2.13 renamed
all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and reduce_scatter_single (the old names
warn on every call); older releases have only the old ones. Same arguments either way."""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
