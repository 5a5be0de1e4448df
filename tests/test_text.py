"""optbook.text: the shipped corpus, its character tokenizer, the fixed split and the batch samplers."""

import pytest
import torch

from optbook import text


def test_corpus_is_the_recorded_file():
    s = text.load_text()
    assert len(s) == 366_194 and s.count("\n") == 2_746
    assert s.startswith("In the beginning God created the heaven and the earth.\n")
    assert s.endswith("throughout all their journeys.\n")


def test_tokenizer_round_trip_and_errors():
    tok = text.CharTokenizer("hello world")
    assert tok.vocab == " dehlorw" and tok.vocab_size == 8
    ids = tok.encode("hold")
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 5, 4, 1]
    assert tok.decode(ids) == "hold"
    with pytest.raises(ValueError, match="Invalid s"):
        tok.encode("hex")
    with pytest.raises(ValueError, match="Invalid ids"):
        tok.decode([8])
    with pytest.raises(ValueError, match="Invalid text"):
        text.CharTokenizer("")


def test_split_is_fixed_disjoint_and_cut_at_a_line():
    split = text.load_corpus()
    tok = split.tokenizer
    assert tok.vocab_size == 62
    assert (split.train.numel(), split.val.numel()) == (329_688, 36_506)
    assert tok.decode(split.train[-1:]) == "\n"
    assert tok.decode(torch.cat([split.train, split.val])) == text.load_text()
    with pytest.raises(ValueError, match="Invalid val_fraction"):
        text.load_corpus(1.0)


def test_sample_batch_shapes_targets_and_determinism():
    tokens = torch.arange(100)
    x, y = text.sample_batch(tokens, 4, 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)                      # targets are the next token
    x2, _ = text.sample_batch(tokens, 4, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    assert int(y.max()) <= 99
    with pytest.raises(ValueError, match="Invalid seq_len"):
        text.sample_batch(tokens, 4, 100)
    with pytest.raises(TypeError, match="Invalid batch_size"):
        text.sample_batch(tokens, 4.0, 8)


def test_eval_batches_cover_both_ends():
    tokens = torch.arange(50)
    x, y = text.eval_batches(tokens, 9, 5)
    assert x.shape == (5, 9) and torch.equal(y, x + 1)
    assert int(x[0, 0]) == 0 and int(y[-1, -1]) == 49
    with pytest.raises(ValueError, match="Invalid n_windows"):
        text.eval_batches(tokens, 9, 0)
