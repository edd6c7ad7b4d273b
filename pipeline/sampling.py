"""Sampling and acceptance math for speculative decoding, shared by collect, distill and eval. **p is the target
distribution, q the draft's** (the papers' convention, not gpt-fast's); functions are pure, act on the last dimension
of [..., V] tensors, and compute probabilities in fp32. Leviathan et al. 2023 (arXiv:2211.17192, eq. 1, Thm 3.8) and
Chen et al. 2023 (arXiv:2302.01318, Algorithm 2): accept with min(1, p/q), resample from norm(max(0, p − q)).
"""
import hashlib
from dataclasses import asdict, dataclass, replace

import torch

from pipeline.errors import PipelineError


@dataclass(frozen=True)
class Sampling:
    """One sampling distribution: temperature (0 = greedy), then top-k (0 = off), then top-p (1 = off): the target's
    serving settings; the draft's q is the same filters at its own temperature (`with_temperature`)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_dict(cls, values: dict) -> "Sampling":
        """From a config or manifest mapping; missing or null keys take the neutral value."""
        return cls(float(values.get("temperature") or 0.0), int(values.get("top_k") or 0),
                   float(values.get("top_p") or 1.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_temperature(self, temperature: float) -> "Sampling":
        return replace(self, temperature=float(temperature))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)

    def to_dict(self) -> dict:
        return asdict(self)


def validate_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raises a one-line PipelineError for sampling settings that define no distribution."""
    if temperature is None or not isinstance(temperature, (int, float)) or temperature < 0:
        raise PipelineError(f"temperature must be >= 0 (0 = greedy), got {temperature}: pass a non-negative value")
    if top_k is None or not isinstance(top_k, int) or top_k < 0:
        raise PipelineError(f"top_k must be an integer >= 0 (0 = off), got {top_k}: pass a non-negative integer")
    if top_p is None or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise PipelineError(f"top_p must be in (0, 1] (1 = off), got {top_p}: pass a value in that range")


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from (seed, domain, shard, turn, request, ...): independent of process and order."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big") >> 1


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [..., V] -> fp32 probabilities after temperature (0: one-hot argmax), top-k, then top-p (HF's order);
    the nucleus is the smallest most-likely set reaching top_p, at least one token."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the first token is never dropped.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of probs [..., V]: argmax(p_i / E_i), E_i ~ Exp(1) (the Gumbel-max trick's exponential race,
    as gpt-fast): exact, and unlike torch.multinomial no host sync on CUDA."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): what to sample from after a rejection (Leviathan et al. 2023, Alg. 1); p where p ≤ q
    everywhere (then p == q and a rejection has probability 0)."""
    residual = (p.float() - q.float()).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), p.float())


def verify_draft(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative verification (Chen et al. 2023, Alg. 2) over γ draft tokens.

    p: [γ+1, V] target probabilities at each draft position plus the bonus position;
    q: [γ, V] the distributions the draft tokens were actually sampled from; draft_tokens: [γ].
    Accepts token i with probability min(1, p_i(x)/q_i(x)); at the first rejection n the next token
    comes from residual(p_n, q_n); if all γ are accepted it is a bonus token from p_γ.
    Returns (n_accepted, next_token), both 0-dim LongTensors on p's device (no host sync here).
    """
    gamma = draft_tokens.shape[0]
    rows = torch.arange(gamma, device=p.device)
    p_x, q_x = p[rows, draft_tokens], q[rows, draft_tokens]
    u = torch.rand(gamma, device=p.device, generator=generator)
    # u < p/q written without the division; strict '<' so greedy (one-hot p) never accepts p(x) = 0.
    accepted = u * q_x < p_x
    n_accepted = accepted.long().cumprod(0).sum()
    # A zero row after q makes the "all accepted" case the residual of p_γ against 0, i.e. p_γ itself.
    q_ext = torch.cat([q.float(), torch.zeros_like(p[:1], dtype=torch.float32)])
    index = n_accepted.view(1)
    next_probs = residual_distribution(p.index_select(0, index), q_ext.index_select(0, index))
    return n_accepted, sample(next_probs, generator)[0]


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σ_x min(p(x), q(x)) along the last dim: the probability that a token sampled from q is
    accepted against p (Leviathan et al. 2023, Def. 3.1 / Thm 3.5; equals 1 - TV(p, q))."""
    return torch.minimum(p.float(), q.float()).sum(-1)


def expected_accepted_length(alpha, gamma: int):
    """Expected tokens per target pass, (1 - α^(γ+1)) / (1 - α) (Leviathan et al. 2023, eq. 1);
    γ + 1 at α = 1. Works on floats and tensors."""
    if isinstance(alpha, torch.Tensor):
        safe = torch.where(alpha < 1, alpha, torch.zeros_like(alpha))
        return torch.where(alpha < 1, (1 - safe ** (gamma + 1)) / (1 - safe), torch.full_like(alpha, gamma + 1.0))
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
