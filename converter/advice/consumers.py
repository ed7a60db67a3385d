"""Where a converted pair is proven to run with its assistant drafting, and the command that runs it there.

Read from the ledger alone: vLLM's engine rows (tokens and every draft proposal equal to the original pair's), and
every other consumer's rows that say whether the assistant drafts (compat.proves_drafting). A consumer is listed
for a layout only where such a row passed; each entry quotes the releases and the rows behind it. The card (hub/)
and `inspect` of an output print the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pairing import DEFAULT_SPECULATIVE_TOKENS, serve_line
from .ledger import CHECK_ENGINE, PASS, VLLM, load_ledger, version_key
from .tables import proves_drafting

TRANSFORMERS = "transformers"
LLAMACPP = "llama.cpp"
MLX_VLM = "mlx-vlm"


@dataclass(frozen=True)
class DraftingProof:
    """One consumer proven to run a layout's pair with the assistant drafting."""

    consumer: str
    versions: tuple[str, ...]  # the consumer's releases with a passing row
    rows: int
    cases: tuple[str, ...]

    def evidence(self) -> str:
        """"transformers 5.8.0, 5.14.1 (9 rows: 26b-a4b-moe, 31b-mm-2shards, e2b)"."""
        return (f"{self.consumer} {', '.join(self.versions)} ({self.rows} row{'s' if self.rows != 1 else ''}: "
                f"{', '.join(self.cases)})")

    def document(self, target: str, assistant: str, layout: str) -> dict[str, object]:
        return {"consumer": self.consumer, "versions": list(self.versions), "rows": self.rows,
                "cases": list(self.cases), "command": drafting_command(self.consumer, target, assistant, layout)}


def drafting_proofs(variant: str) -> list[DraftingProof]:
    """The consumers whose ledger rows show `variant` (a layout with its options) drafting, vLLM first."""
    rows = [r for r in load_ledger() if r.variant == variant and r.verdict == PASS and (
        (r.consumer == VLLM and r.check == CHECK_ENGINE) or (r.consumer != VLLM and proves_drafting(r)))]
    proofs = []
    for consumer in sorted({r.consumer for r in rows}, key=lambda c: (c != VLLM, c)):
        mine = [r for r in rows if r.consumer == consumer]
        if consumer in COMMANDS:
            proofs.append(DraftingProof(consumer, tuple(sorted({r.consumer_version for r in mine}, key=version_key)),
                                        len(mine), tuple(sorted({r.case for r in mine}))))
    return proofs


def _vllm(target: str, assistant: str, layout: str) -> str:
    return serve_line(target=target, assistant=assistant, layout=layout)


def _transformers(target: str, assistant: str, layout: str) -> str:
    # num_assistant_tokens: transformers' assisted generation reads it from the assistant's generation config and
    # fails on None (docs/DESIGN.md "Other consumers of a Gemma 4 pair")
    return (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n'
            f'target = AutoModelForCausalLM.from_pretrained("{target}")\n'
            f'assistant = AutoModelForCausalLM.from_pretrained("{assistant}")\n'
            f'assistant.generation_config.num_assistant_tokens = {DEFAULT_SPECULATIVE_TOKENS}\n'
            f'inputs = AutoTokenizer.from_pretrained("{target}")("Hello", return_tensors="pt")\n'
            f'out = target.generate(**inputs, assistant_model=assistant, do_sample=False, max_new_tokens=64)')


def _llamacpp(target: str, assistant: str, layout: str) -> str:
    return (f"python convert_hf_to_gguf.py {target} --outfile target.gguf\n"
            f"python convert_hf_to_gguf.py {assistant} --outfile assistant.gguf\n"
            f"llama-server -m target.gguf --spec-draft-model assistant.gguf --spec-type draft-mtp "
            f"--spec-draft-n-max {DEFAULT_SPECULATIVE_TOKENS}")


def _mlx_vlm(target: str, assistant: str, layout: str) -> str:
    # the verified block is the bonus token and the drafts: --num-speculative-tokens N is a block of N + 1
    return (f"python -m mlx_vlm.generate --model {target} --draft-model {assistant} --draft-kind mtp "
            f"--draft-block-size {DEFAULT_SPECULATIVE_TOKENS + 1} --prompt Hello --max-tokens 64 --temperature 0")


# consumer -> (code block language, command for (target, assistant, layout)); a consumer with drafting rows but no
# command here is not listed (its rows still show in docs/COMPATIBILITY.md)
COMMANDS = {VLLM: ("bash", _vllm), TRANSFORMERS: ("python", _transformers), LLAMACPP: ("bash", _llamacpp),
            MLX_VLM: ("bash", _mlx_vlm)}


def drafting_command(consumer: str, target: str, assistant: str, layout: str) -> str:
    return COMMANDS[consumer][1](target, assistant, layout)


def command_language(consumer: str) -> str:
    return COMMANDS[consumer][0]
