"""Launch the decode kernels a few times at large batch, for `ncu` (Nsight Compute) to profile:

    ncu --clock-control none -k regex:kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m benchmarks.profile_decode

Launch order: KDA B=256 T=1 ([K,V] state) x3, lightning B=256 T=1 x3.
"""

import torch

from benchmarks.variants import _kda_args, _la_args
from fla_cula.kernels import kda_decode, lightning_decode


def main() -> None:
    dev = torch.device("cuda")
    a = _kda_args(256, 1, False, dev)
    for _ in range(3):
        kda_decode.run(*a)
    b = _la_args(256, 1, dev)
    for _ in range(3):
        lightning_decode.run(*b)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
