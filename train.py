"""Entry point: `python train.py model=qwen7b engine=stream ...`. Composes the Hydra config and hands it to the
Trainer (engine/trainer.py), which holds all training logic."""

import os

# Fewer, growable segments: the streamed engine's long-lived buffers and per-layer temporaries fragment the
# default allocator's fixed-size segments (seen as GiBs "reserved but unallocated" at OOM on the H200).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import hydra  # noqa: E402

from engine.config import register  # noqa: E402

register()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    from engine.trainer import main as run

    run(cfg)


if __name__ == "__main__":
    main()
