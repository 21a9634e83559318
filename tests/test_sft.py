"""The SFT warm start (sao/trainer/sft.py): packed steps give the padded batch's loss and gradients,
cost fewer positions, and a whole short SFT run learns the same model either way."""

import random

import pytest
import torch

from sao.models.tiny import load_model
from sao.trainer.sft import collate_examples, pack_examples, sft_loss, sft_train

PAD = 0


def _examples(lengths, seed=0):
    """Random ids; a prompt of 4 (no loss), then loss and no-loss tokens mixed, as in a tool episode."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        mask = [0] * 4 + (torch.rand(n - 4, generator=g) > 0.4).int().tolist()
        out.append((ids, mask))
    return out


LENGTHS = [40, 9, 26, 33, 12, 60, 7, 21]


def test_packed_layout_holds_every_token_once_in_fewer_positions():
    examples = _examples(LENGTHS)
    ids, pos, mask = pack_examples(examples, PAD)
    padded, _, padded_mask = collate_examples(examples, PAD)
    assert ids.shape[1] == 60 and ids.numel() < padded.numel()  # 4 rows of 60 instead of 8
    assert mask.sum() == padded_mask.sum()
    rows = [(r, start) for r in range(ids.shape[0]) for start in (pos[r] == 0).nonzero().flatten().tolist()]
    found = {tuple(ids[r, s:s + n].tolist()) for r, s in rows for n in LENGTHS if torch.equal(pos[r, s:s + n], torch.arange(n))}
    assert all(tuple(tok) in found for tok, _ in examples)


def test_packed_loss_and_gradients_equal_the_padded_batch(arch_model_dir):
    examples = _examples(LENGTHS)
    losses, grads = [], []
    for pack in (False, True):
        model = load_model(arch_model_dir).train()
        loss = sft_loss(model, examples, PAD, pack)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_example_sees_another_in_its_row(arch_model_dir):
    """An example packed second in its row (26 after 33) has the loss it has alone."""
    model = load_model(arch_model_dir).eval()
    alone = sft_loss(model, _examples([26]), PAD)
    mixed = _examples(LENGTHS)
    mixed[2] = _examples([26])[0]
    for i in range(len(mixed)):
        if i != 2:
            mixed[i] = (mixed[i][0], [0] * len(mixed[i][1]))  # only example 3 has loss tokens
    torch.testing.assert_close(sft_loss(model, mixed, PAD), alone, rtol=1e-5, atol=1e-6)


def test_a_loss_token_in_first_position_is_refused():
    with pytest.raises(ValueError, match="first token"):
        pack_examples([([5, 6, 7], [1, 1, 1])], PAD)


def test_short_sft_run_same_losses_packed_or_padded(arch_model_dir):
    pool = _examples([random.Random(i).randint(8, 50) for i in range(64)], seed=3)

    def sample(rng):
        return pool[rng.randrange(len(pool))]

    runs = [sft_train(load_model(arch_model_dir), sample, steps=6, batch_size=8, lr=5e-3, pad_id=PAD, pack=pack)
            for pack in (False, True)]
    assert runs[1] == pytest.approx(runs[0], rel=1e-4)
    assert runs[1][-1] < runs[1][0]
