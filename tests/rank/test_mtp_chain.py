"""The chained-draft forward tiny-glm's MTP layer trains with, and the engine-style check, against a chain
run one step at a time through transformers' own KV cache."""

from collections.abc import Iterator

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from serve_app.fixtures.tiny_glm import BUILTIN_DIR, TEMPLATE_PATH  # noqa: E402
from serve_app.fixtures.tiny_glm.data import corpus_examples, tokenize_examples  # noqa: E402
from serve_app.fixtures.tiny_glm.mtp import MtpLayer, load_mtp  # noqa: E402
from serve_app.fixtures.tiny_glm.mtp_chain import chain_logits, depth_mask, leading_drafts  # noqa: E402

DEPTH = 4


@pytest.fixture(scope="module")
def tiny_glm() -> Iterator[tuple[transformers.Glm4MoeForCausalLM, MtpLayer, list]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()  # the trunk does not load the MTP tensors, and says so
    model = transformers.Glm4MoeForCausalLM.from_pretrained(BUILTIN_DIR).eval()
    mtp = load_mtp(model, load_file(BUILTIN_DIR / "model.safetensors"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(BUILTIN_DIR)
    examples = tokenize_examples(tokenizer, corpus_examples(TEMPLATE_PATH.read_text(encoding="utf-8")))
    with torch.no_grad():
        yield model, mtp, examples[::6]  # a handful of prompts with replies long and short
    torch.set_num_threads(before)


def _step_by_step(model, mtp: MtpLayer, ids: torch.Tensor, anchor: int) -> int:
    """Leading right drafts from `anchor`: a fresh DynamicCache filled with the depth-1 rows 0..anchor (trunk
    hidden, true next token), then each step appends one row fed the previous draft and output."""
    hidden = model.model(ids).last_hidden_state
    cache = transformers.DynamicCache()
    positions = torch.arange(anchor + 1)[None]
    embeds = model.model.embed_tokens(ids[:, 1 : anchor + 2])
    out = mtp(embeds, hidden[:, : anchor + 1], model.model.rotary_emb(embeds, positions), None, positions, cache)
    draft = mtp.logits(out[:, -1:], model.lm_head).argmax(-1)
    out = out[:, -1:]
    leading = 0
    for j in range(1, DEPTH + 1):
        if anchor + j + 1 >= ids.shape[1] or int(draft) != int(ids[0, anchor + j + 1]):
            break
        leading += 1
        at = torch.tensor([[anchor + j]])  # the next step's row
        embeds = model.model.embed_tokens(draft)
        out = mtp(embeds, out, model.model.rotary_emb(embeds, at), None, at, cache)
        draft = mtp.logits(out, model.lm_head).argmax(-1)
    return leading


def test_engine_style_check_is_a_chain_run_step_by_step(tiny_glm) -> None:
    model, mtp, examples = tiny_glm
    for example in examples[:3]:
        ids = torch.tensor([example.prompt_ids + example.reply_ids])
        batched = leading_drafts(model, mtp, ids, len(example.prompt_ids), DEPTH).tolist()
        anchors = range(len(example.prompt_ids) - 2, ids.shape[1] - 2)
        assert batched == [_step_by_step(model, mtp, ids, t) for t in anchors], example.name


def test_teacher_forced_training_forward_drafts_what_the_engine_drafts(tiny_glm) -> None:
    # While a chain's drafts are right, it is fed the true tokens: the training forward (all depths over the
    # whole sequence) must then give the engine's drafts, so the same count of leading right ones.
    model, mtp, examples = tiny_glm
    for example in examples:
        ids = torch.tensor([example.prompt_ids + example.reply_ids])
        hidden = model.model(ids).last_hidden_state
        guesses = torch.stack([d[0].argmax(-1) for d in chain_logits(model, mtp, ids, hidden, DEPTH)])  # [D, L-1]
        anchors = torch.arange(len(example.prompt_ids) - 2, ids.shape[1] - 2)
        # Depth j's row of the chain from anchor t is t+j-1, and guesses x_{t+j+1}.
        rows = (anchors[None] + torch.arange(DEPTH)[:, None]).clamp(max=ids.shape[1] - 2)
        truth = torch.nn.functional.pad(ids[0], (0, DEPTH), value=-1)[rows + 2]
        right = guesses.gather(1, rows) == truth
        teacher_forced = right.int().cumprod(dim=0).sum(dim=0)
        assert teacher_forced.tolist() == leading_drafts(model, mtp, ids, len(example.prompt_ids), DEPTH).tolist()


def test_depth_mask_sees_depth_one_up_to_the_anchor_then_the_chain() -> None:
    allowed = depth_mask(3, 5)[0, 0] == 0  # [5 rows, 3 depths x 5 positions]
    # Row 4 at depth 3 is the third step of the chain from anchor 2.
    assert allowed[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert allowed.sum(dim=1).tolist() == [1, 2, 3, 4, 5]  # rows 0, 1 would start before the text: chain keys only
    assert (depth_mask(1, 4)[0, 0] == 0).tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
