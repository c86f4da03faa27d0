"""Build everything the llm-foundry example needs, offline, into one directory.

    python examples/llmfoundry/prepare.py /tmp/uneven-mpt            # 2 ranks: train 40 + 21, eval 12 + 5 sequences
    python examples/llmfoundry/prepare.py /tmp/uneven-mpt --train 40 21 13 --eval 12 5 0   # 3 ranks

Writes ``DIR/tokenizer/`` (a byte-level BPE trained on the spot with ``tokenizers`` on Python's own
help texts, ``pydoc_data.topics``, saved with ``PreTrainedTokenizerFast.save_pretrained``) and
``DIR/data/{train,eval}/rank{R}.npy``: rank ``R``'s own token sequences, ``--seq-len`` tokens each
(the help texts tokenized, joined with ``<|endoftext|>`` and cut into chunks; no padding). Each rank
gets the number of sequences given, so the shards are as uneven as asked; no sequence is in two shards.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = '<|endoftext|>'


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) with ``vocab_size`` tokens, ``<|endoftext|>`` as EOS and padding."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('out', type=Path)
    parser.add_argument('--train', type=int, nargs='+', default=[40, 21], help='sequences per rank (train)')
    parser.add_argument('--eval', type=int, nargs='+', default=[12, 5], help='sequences per rank (eval)')
    parser.add_argument('--seq-len', type=int, default=32)
    parser.add_argument('--vocab-size', type=int, default=384)
    args = parser.parse_args()
    if len(args.train) != len(args.eval):
        parser.error(f'--train and --eval need one count per rank, got {len(args.train)} and {len(args.eval)}')

    texts = [topics[k] for k in sorted(topics)]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    tokenizer.save_pretrained(args.out / 'tokenizer')

    ids = np.array([t for text in texts for t in tokenizer(text)['input_ids'] + [tokenizer.eos_token_id]])
    chunks = ids[: len(ids) // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    needed = sum(args.train) + sum(args.eval)
    if needed > len(chunks):
        parser.error(f'asked for {needed} sequences of {args.seq_len} tokens, the corpus has {len(chunks)}')
    start = 0
    for split, counts in (('train', args.train), ('eval', args.eval)):
        (args.out / 'data' / split).mkdir(parents=True, exist_ok=True)
        for rank, n in enumerate(counts):
            np.save(args.out / 'data' / split / f'rank{rank}.npy', chunks[start : start + n].astype(np.int64))
            start += n
    print(
        f'{args.out}: tokenizer of {len(tokenizer)} tokens; sequences of {args.seq_len} tokens per rank: '
        f'train {args.train}, eval {args.eval}'
    )


if __name__ == '__main__':
    main()
