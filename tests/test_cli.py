import numpy as np

from st_fastbackend import SentenceTransformer
from st_fastbackend.cli import main


def test_encode_command_writes_the_embeddings(st_model, texts, tmp_path):
    folder = st_model("mistral", pooling_mode="lasttoken")
    lines = [t for t in texts if t]  # one text per line: an empty line stays an empty text, skip it here
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    main(["encode", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy")])
    expected = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(lines)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)
