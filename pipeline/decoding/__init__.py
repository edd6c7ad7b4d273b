"""The decoder: lossless speculative decoding (chains and token trees) and plain decoding, as streams or outputs
(docs/architecture.md, "The decoder", lists the modules; stream.py and batch.py show their entry points).

    out = speculative_generate(target, draft, input_ids, plan=DraftPlan(4), sampling=Sampling(0.7),
                               max_new_tokens=128)  # or plan=spec.plan(domain, sampling): a calibration
    out.tokens, out.stats.acceptance_rate, out.stats.mean_accepted_length
"""
from pipeline.decoding.batch import BatchOutput, autoregressive_generate_batch, speculative_generate_batch
from pipeline.decoding.cost import pass_speedup, predicted_speedup, verify_cost
from pipeline.decoding.draft_length import POLICIES, DraftLength
from pipeline.decoding.generate import (GREEDY, autoregressive_generate, autoregressive_stream, speculative_generate,
                                        speculative_stream)
from pipeline.decoding.guard import Guard, GuardSettings, GuardStats
from pipeline.decoding.plan import PLAIN, DraftPlan, as_drafting
from pipeline.decoding.loop import DecodeStats, GenerationOutput, uses_sliding_window
from pipeline.decoding.stream import TokenStream
from pipeline.decoding.tree import MAX_TREE_NODES, Tree, TreeStats, nodes, parse_tree, tree_key
from pipeline.sampling import Sampling

__all__ = ["BatchOutput", "DecodeStats", "DraftLength", "DraftPlan", "GREEDY", "GenerationOutput", "Guard", "GuardSettings",
           "GuardStats", "MAX_TREE_NODES", "PLAIN", "POLICIES", "Sampling", "TokenStream", "Tree", "TreeStats", "as_drafting",
           "autoregressive_generate", "autoregressive_generate_batch", "autoregressive_stream", "nodes", "parse_tree",
           "pass_speedup", "predicted_speedup", "speculative_generate", "speculative_generate_batch",
           "speculative_stream", "tree_key", "uses_sliding_window", "verify_cost"]
