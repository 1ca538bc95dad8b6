"""Training in the framework: the reference target LM and the speculative-decoding drafters distilled from it.

    from research_lm.harness.train import TrainConfig, train_target, train_head

    target = train_target(TrainConfig(output_dir="outputs/train/target", steps=500))
    head = train_head("eagle3", TrainConfig(output_dir="outputs/train/eagle3", steps=300),
                      target=str(target.output_dir), head={"draft_vocab_size": 512, "ttt_steps": 3})

| module | owns |
| --- | --- |
| `config` | `TrainConfig`: the knobs every trainer shares |
| `data` | the stdlib + pydoc corpus, tokenized (cached), split by document, packed into windows |
| `loop` | `fit`: AdamW, warmup + cosine, logging, held-out eval, resume checkpoints |
| `target` | `train_target`: a Llama from scratch; output = a Hugging Face checkpoint |
| `teacher` | `FrozenTarget`: the target's features and logits for self-distillation |
| `eagle3`, `eagle`, `medusa`, `draft` | one objective per drafter, written in its published layout |
| `regenerate` | the target's own continuations in place of the corpus text (`train.regenerate.fraction`) |
| `heads` | `train_head(method, ...)`: the shared driver for the drafters |
| `tasks` | the Hydra tasks behind `experiment=train_*` |

Everything is CPU-runnable (tiny shapes); on CUDA the forward runs under bf16 autocast.
"""

from research_lm.harness.train.artifacts import TrainResult
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.heads import METHODS, train_head
from research_lm.harness.train.target import train_target

__all__ = ["TrainConfig", "TrainResult", "train_target", "train_head", "METHODS"]
