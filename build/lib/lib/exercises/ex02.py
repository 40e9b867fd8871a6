"""Notebook 02 (DPO reduces toxicity): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd
import torch

from lib.exercises import generator, run_cases


def share_of_fall(start: float, middle: float, end: float) -> float:
    return float("nan") if start == end else (start - middle) / (start - end)


def check_share_of_fall(fn) -> None:
    run_cases(fn, share_of_fall, [((0.69, 0.27, 0.02), {}), ((0.24, 0.20, 0.18), {}), ((1.0, 1.0, 0.5), {}),
                                  ((0.3, 0.35, 0.2), {}), ((0.5, 0.4, 0.5), {})])


def steer_at_norm(direction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    d = direction.detach().float().cpu()
    return d / d.norm() * like.detach().float().cpu().norm()


def check_steer_at_norm(fn) -> None:
    g = generator(0)
    run_cases(fn, steer_at_norm, [((torch.randn(8, generator=g).double(), 3 * torch.randn(8, generator=g)), {}),
                                  ((torch.randn(5, generator=g).half(), torch.randn(5, generator=g) / 10), {})], rtol=1e-3)


def most_different(prompts: list, base: list, dpo_: list, tox_base, tox_dpo, k: int) -> pd.DataFrame:
    tb_, td_ = np.asarray(tox_base, dtype=float), np.asarray(tox_dpo, dtype=float)
    order = np.argsort(-np.abs(td_ - tb_), kind="stable")[:k]
    return pd.DataFrame({"prompt": [prompts[i] for i in order], "base": [base[i] for i in order],
                         "DPO": [dpo_[i] for i in order], "tox_base": tb_[order], "tox_DPO": td_[order]})


def check_most_different(fn) -> None:
    rng = np.random.default_rng(0)
    cases = []
    for n, k in [(9, 5), (4, 2), (6, 6)]:
        p = [f"prompt {i}" for i in range(n)]
        cases.append(((p, [f"base {i}" for i in range(n)], [f"dpo {i}" for i in range(n)],
                       rng.random(n).tolist(), rng.random(n), k), {}))
    run_cases(fn, most_different, cases)
