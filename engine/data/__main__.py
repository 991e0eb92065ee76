"""`python -m engine.data prepare --tokenizer tokenizer.json --out tokens.bin <files or dirs>`: see corpus.py."""

import sys

from engine.data.corpus import main

if __name__ == "__main__":
    sys.exit(main())
