"""A Hugging Face GPT-2 in Composer's ``HuggingFaceModel`` on uneven shards: UnevenJoin next to stock Composer.

    composer -n 2 examples/huggingface_gpt2.py                     # shards of 40 and 21, eval 12 and 5
    composer -n 2 examples/huggingface_gpt2.py --train 30 7 --eval 3 9

A tiny GPT-2 (built from a config, nothing downloaded, no dropout) learns Python's own help texts
(``pydoc_data.topics``) byte by byte: every rank reads its own sequences of 32 bytes, as many as
``--train`` and ``--eval`` say. Training runs twice from the same weights, with ``UnevenJoin()``
and with ``UnevenJoin(enable=False)`` (exactly stock Composer), 2 epochs, evaluating after each
epoch with Composer's ``LanguageCrossEntropy``. Rank 0 prints, for both: samples trained, tokens
evaluated, the eval loss, and the eval loss of one process evaluating all ranks' eval data with the
same final weights.
"""

from __future__ import annotations

import argparse
import logging
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from composer import Trainer
from composer.core import Evaluator
from composer.metrics.nlp import LanguageCrossEntropy
from composer.models import HuggingFaceModel
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel

from composer_join import UnevenJoin

LENGTH = 32


def byte_sequences() -> torch.Tensor:
    """Python's help texts as bytes, cut into sequences of ``LENGTH``."""
    data = torch.tensor(list(''.join(topics[k] for k in sorted(topics)).encode()), dtype=torch.long)
    return data[: len(data) // LENGTH * LENGTH].view(-1, LENGTH)


def shards(counts: list[int], offset: int) -> list[torch.Tensor]:
    """Consecutive, disjoint blocks of sequences, one per rank, starting at sequence ``offset``."""
    seqs, out = byte_sequences(), []
    for n in counts:
        out.append(seqs[offset : offset + n])
        offset += n
    return out


class Shard(IterableDataset):
    """One rank's sequences, streamed in order, with ``__len__`` (the way sharded data reaches Composer)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': ids.clone()}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256,
            n_positions=LENGTH,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def fit(join: UnevenJoin, train: torch.Tensor, evaluate: torch.Tensor, batch_size: int) -> dict:
    model = HuggingFaceModel(gpt2(), use_logits=True, eval_metrics=[LanguageCrossEntropy()])
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(Shard(train), batch_size=batch_size, collate_fn=collate),
        eval_dataloader=Evaluator(
            label='eval',
            metric_names=['LanguageCrossEntropy'],
            dataloader=DataLoader(Shard(evaluate), batch_size=batch_size, collate_fn=collate),
        ),
        eval_interval='1ep',
        max_duration='2ep',
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        algorithms=[join],
        device='cpu',
        progress_bar=False,
        seed=0,
    )
    trainer.fit()
    metric = trainer.state.eval_metrics['eval']['LanguageCrossEntropy']
    tokens = torch.tensor(int(metric.total_items))  # this rank's: torchmetrics keeps local state after compute()
    dist.all_reduce(tokens)
    result = {'samples': int(trainer.state.timestamp.sample), 'tokens': int(tokens), 'loss': float(metric.compute())}
    trainer.close()
    result['model'] = model.model
    return result


def one_process_loss(model: GPT2LMHeadModel, ids: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--train', type=int, nargs='+', default=[40, 21], help='training sequences per rank')
    parser.add_argument('--eval', type=int, nargs='+', default=[12, 5], help='eval sequences per rank')
    parser.add_argument('--batch-size', type=int, default=4)
    args = parser.parse_args()
    logging.getLogger('composer.models.huggingface').setLevel(logging.ERROR)  # "no tokenizer": none is needed
    dist.initialize_dist('cpu')
    world, rank = dist.get_world_size(), dist.get_global_rank()
    if len(args.train) != world or len(args.eval) != world:
        parser.error(f'--train and --eval need one count per rank ({world} ranks)')
    train, evaluate = shards(args.train, 0), shards(args.eval, sum(args.train))
    all_eval = torch.cat(evaluate)
    lines = [
        f'{world} ranks, training sequences {args.train}, eval sequences {args.eval}, batch {args.batch_size}, '
        f'2 epochs; {LENGTH} bytes per sequence',
        f'{"":15} {"samples trained":>16} {"tokens evaluated":>17} {"eval loss":>10} {"one process":>12}',
    ]
    for name, join in (('UnevenJoin', UnevenJoin()), ('stock Composer', UnevenJoin(enable=False))):
        res = fit(join, train[rank], evaluate[rank], args.batch_size)
        single = one_process_loss(res['model'], all_eval)
        lines.append(
            f'{name:15} {res["samples"]:>7} of {2 * sum(args.train):<6} '
            f'{res["tokens"]:>8} of {len(all_eval) * (LENGTH - 1):<6} {res["loss"]:>10.6f} {single:>12.6f}'
        )
    if rank == 0:
        print('\n'.join(lines))


if __name__ == '__main__':
    main()
