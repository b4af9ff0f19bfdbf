"""The chapter manifest: which part, notebook and modules make each of the book's 43 chapters.

A chapter is the unit of the book. It owns

* a **part** (``lm`` for Part I, ``rag`` for Part II, ``agents`` for Part III), which is also the
  sub-package its modules live in (the kernels of a chapter live in ``llmbook.kernels``);
* a **notebook** in ``book/`` (``None`` until the chapter is written);
* its **modules**: the only modules allowed to register the chapter's equation ids with
  :func:`llmbook.registry.implements`. Tests of those ids live in the mirrored test files
  (``llmbook/lm/attention.py`` -> ``tests/lm/test_attention.py``).

The registry enforces the second and third points at import time and in ``tests/test_registry.py``;
``python -m llmbook chapters`` prints this table. Adding a chapter means adding its notebook and
modules here first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

__all__ = ["Chapter", "CHAPTERS", "SHARED_MODULES", "chapter", "chapter_of_module", "mirrored_test_path"]

PARTS = {"lm": "Part I. Language models", "rag": "Part II. Retrieval-augmented generation",
         "agents": "Part III. Agents and reinforcement learning"}


@dataclass(frozen=True)
class Chapter:
    """One row of the manifest."""

    number: int
    part: str
    notebook: str | None
    modules: tuple[str, ...] = ()

    @property
    def written(self) -> bool:
        """True once the chapter has a notebook."""
        return self.notebook is not None

    def test_paths(self) -> tuple[str, ...]:
        """The test files that may mark this chapter's equation ids (one per owning module)."""
        return tuple(mirrored_test_path(m) for m in self.modules)


def _part(number: int) -> str:
    return "lm" if number <= 19 else "rag" if number <= 31 else "agents"


_WRITTEN: dict[int, tuple[str | None, tuple[str, ...]]] = {
    1: ("book/01-probability.ipynb", ("llmbook.lm.probability", "llmbook.lm.ngram")),
    2: ("book/02-blocks.ipynb", ("llmbook.lm.embeddings", "llmbook.lm.blocks", "llmbook.lm.init", "llmbook.lm.gpt",
                                 "llmbook.lm.checkpoints")),
    3: ("book/03-attention.ipynb", ("llmbook.lm.attention", "llmbook.lm.efficient_attention",
                                    "llmbook.lm.local_attention", "llmbook.lm.flash",
                                    "llmbook.kernels.flash_attention", "llmbook.kernels.flash_attention_kernels")),
    4: ("book/04-positions.ipynb", ("llmbook.lm.positions", "llmbook.lm.rope", "llmbook.lm.position_bias",
                                    "llmbook.lm.context_extension", "llmbook.lm.long_context")),
    5: ("book/05-normalization.ipynb", ("llmbook.lm.norms", "llmbook.lm.qk_norm", "llmbook.lm.welford")),
    6: ("book/06-activations.ipynb", ("llmbook.lm.activations", "llmbook.lm.ffn_experiment")),
    7: ("book/07-losses.ipynb", ("llmbook.lm.losses", "llmbook.lm.contrastive", "llmbook.lm.objectives",
                                 "llmbook.lm.distillation")),
    8: ("book/08-optimization.ipynb", ("llmbook.lm.optim", "llmbook.lm.adafactor", "llmbook.lm.schedules",
                                       "llmbook.lm.training", "llmbook.lm.memory", "llmbook.lm.data_parallel",
                                       "llmbook.lm.fsdp", "llmbook.lm.muon")),
    9: ("book/09-decoding.ipynb", ("llmbook.lm.decoding", "llmbook.lm.search")),
    10: ("book/10-alignment.ipynb", ("llmbook.lm.preference", "llmbook.lm.rlhf", "llmbook.lm.assistant",
                                     "llmbook.lm.assistant_recipe")),
    11: ("book/11-peft.ipynb", ("llmbook.lm.lora", "llmbook.lm.adalora", "llmbook.lm.adapters")),
    12: ("book/12-quantization.ipynb", ("llmbook.lm.quantization", "llmbook.lm.nf4", "llmbook.lm.gptq",
                                        "llmbook.lm.quant_formats")),
    13: ("book/13-scaling-laws.ipynb", ("llmbook.lm.scaling", "llmbook.lm.isoflop")),
    14: ("book/14-moe.ipynb", ("llmbook.lm.moe", "llmbook.lm.moe_layer", "llmbook.kernels.moe",
                               "llmbook.kernels.moe_kernels")),
    15: ("book/15-tokenization.ipynb", ("llmbook.lm.pretokenization", "llmbook.lm.pretoken_counts", "llmbook.lm.bpe",
                                         "llmbook.lm.tokenization", "llmbook.lm.word_vectors",
                                         "llmbook.lm.subsampling")),
    16: ("book/16-evaluation.ipynb", ("llmbook.lm.text_metrics", "llmbook.lm.unigram_metrics",
                                      "llmbook.lm.eval_metrics", "llmbook.lm.eval_protocols")),
    17: ("book/17-inference.ipynb", ("llmbook.lm.inference", "llmbook.lm.kv_cache", "llmbook.lm.serving",
                                     "llmbook.lm.serving_costs")),
    18: ("book/18-sequence-models.ipynb", ("llmbook.lm.ssm", "llmbook.lm.recurrent", "llmbook.lm.scan",
                                           "llmbook.lm.rwkv_retnet")),
    19: ("book/19-calibration.ipynb", ("llmbook.lm.calibration", "llmbook.lm.answer_uncertainty")),
    20: ("book/20-similarity.ipynb", ("llmbook.rag.similarity", "llmbook.rag.minhash")),
    21: ("book/21-sparse-retrieval.ipynb", ("llmbook.rag.sparse", "llmbook.rag.language_models")),
    22: ("book/22-dense-retrieval.ipynb", ("llmbook.rag.dense",)),
    23: ("book/23-fusion.ipynb", ("llmbook.rag.fusion", "llmbook.rag.learned_fusion")),
    24: ("book/24-ann.ipynb", ("llmbook.rag.kmeans", "llmbook.rag.ann", "llmbook.rag.hnsw", "llmbook.rag.scann")),
    25: ("book/25-learning-to-rank.ipynb", ("llmbook.rag.ranking", "llmbook.rag.lambdamart")),
    26: ("book/26-retrieval-metrics.ipynb", ("llmbook.rag.metrics", "llmbook.rag.significance")),
    27: ("book/27-chunking.ipynb", ("llmbook.rag.chunking", "llmbook.rag.packing")),
    28: ("book/28-diversity.ipynb", ("llmbook.rag.diversity", "llmbook.rag.diversity_metrics")),
    29: ("book/29-rag-objectives.ipynb", ("llmbook.rag.rag_objectives", "llmbook.rag.ragas",
                                          "llmbook.rag.rag_generation")),
    30: ("book/30-query-expansion.ipynb", ("llmbook.rag.expansion", "llmbook.rag.hyde_writer")),
    31: ("book/31-graphrag.ipynb", ("llmbook.rag.graph", "llmbook.rag.graph_context", "llmbook.rag.graph_search",
                                   "llmbook.rag.world_reports")),
    32: ("book/32-mdp.ipynb", ("llmbook.agents.mdp", "llmbook.agents.pomdp")),
    33: ("book/33-td-learning.ipynb", ("llmbook.agents.td", "llmbook.agents.dqn", "llmbook.agents.dqn_loop",
                                      "llmbook.agents.td_control")),
    34: ("book/34-policy-gradients.ipynb", ("llmbook.agents.policy_gradient", "llmbook.agents.continuous_control",
                                           "llmbook.agents.batched_control", "llmbook.agents.ppo_control",
                                           "llmbook.agents.offpolicy_control")),
    35: ("book/35-returns.ipynb", ("llmbook.agents.returns", "llmbook.agents.eligibility")),
    36: ("book/36-bandits.ipynb", ("llmbook.agents.bandits", "llmbook.agents.regret", "llmbook.agents.linucb",
                                    "llmbook.agents.curiosity")),
    37: ("book/37-planning.ipynb", ("llmbook.agents.dynamic_programming", "llmbook.agents.mcts", "llmbook.agents.mpc",
                                    "llmbook.agents.dyna")),
    38: ("book/38-offline-rl.ipynb", ("llmbook.agents.offline_rl", "llmbook.agents.imitation")),
    39: ("book/39-multi-agent.ipynb", ("llmbook.agents.multi_agent", "llmbook.agents.cooperative")),
    40: ("book/40-llm-agents.ipynb", ("llmbook.agents.llm_agents", "llmbook.agents.agent_decisions",
                                     "llmbook.agents.tool_env", "llmbook.agents.agent_loop",
                                     "llmbook.agents.assistant_tasks", "llmbook.agents.generation",
                                     "llmbook.agents.reflexion_loop", "llmbook.agents.tree_of_thoughts")),
    41: ("book/41-reward-models.ipynb", ("llmbook.agents.reward_models", "llmbook.agents.assistant_rm")),
    42: ("book/42-memory.ipynb", ("llmbook.agents.memory", "llmbook.agents.memory_agent",
                                 "llmbook.agents.memory_stream")),
    43: ("book/43-safety.ipynb", ("llmbook.agents.safety", "llmbook.agents.injection", "llmbook.agents.selective")),
}

# Modules that serve several chapters and register no equation (the Triton runtime of both kernels).
SHARED_MODULES = ("llmbook.kernels.runtime", "llmbook.rag.corpus", "llmbook.rag.encoder", "llmbook.rag.pipeline",
                  "llmbook.rag.collection", "llmbook.agents.envs")

CHAPTERS: dict[int, Chapter] = {
    n: Chapter(n, _part(n), *_WRITTEN.get(n, (None, ()))) for n in range(1, 44)
}


def chapter(number: int) -> Chapter:
    """The manifest row of chapter ``number`` (1..43).

    >>> chapter(3).notebook
    'book/03-attention.ipynb'
    >>> chapter(44)
    Traceback (most recent call last):
    ...
    ValueError: chapter must be one of 1..43, got 44
    """
    if isinstance(number, bool) or not isinstance(number, int) or number not in CHAPTERS:
        raise ValueError(f"chapter must be one of 1..{len(CHAPTERS)}, got {number!r}")
    return CHAPTERS[number]


def chapter_of_module(module: str) -> Chapter | None:
    """The chapter that owns ``module`` (a dotted name), or None for shared infrastructure.

    >>> chapter_of_module("llmbook.lm.attention").number
    3
    >>> chapter_of_module("llmbook.plotting") is None
    True
    """
    for ch in CHAPTERS.values():
        if module in ch.modules:
            return ch
    return None


def mirrored_test_path(module: str) -> str:
    """``llmbook.lm.attention`` -> ``tests/lm/test_attention.py`` (the house's mirrored layout).

    >>> mirrored_test_path("llmbook.kernels.moe")
    'tests/kernels/test_moe.py'
    """
    parts = module.split(".")
    if parts[0] != "llmbook" or len(parts) < 2:
        raise ValueError(f"module {module!r} is not inside the llmbook package")
    return str(PurePosixPath("tests", *parts[1:-1], f"test_{parts[-1]}.py"))


def _validate() -> None:
    """Each module has one owner and lives in its chapter's part (or in kernels)."""
    owners: dict[str, int] = {}
    for ch in CHAPTERS.values():
        for m in ch.modules:
            if m in owners:
                raise ValueError(f"module {m} is owned by chapters {owners[m]} and {ch.number}")
            owners[m] = ch.number
            if m.split(".")[1] not in (ch.part, "kernels"):
                raise ValueError(f"module {m} of chapter {ch.number} must live in llmbook.{ch.part} or llmbook.kernels")


_validate()
