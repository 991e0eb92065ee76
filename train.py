"""Entry point: `python train.py model=qwen7b engine=stream ...`. Composes the Hydra config and hands it to the
Trainer (engine/trainer.py), which holds all training logic."""

import hydra

from engine.config import register

register()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    from engine.trainer import main as run

    run(cfg)


if __name__ == "__main__":
    main()
