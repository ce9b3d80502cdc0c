"""MovieLens readers (ml-100k, ml-1m, ml-20m, RecBole), splits and the offline-tested fetch."""

import zipfile

import numpy as np
import pytest

from jaxrec.datasets import extract_ml100k, fetch_movielens_100k, load_movielens, movielens_split

RATINGS = [
    ("1", "10", 5, 100),
    ("1", "20", 3, 200),
    ("2", "10", 4, 50),
    ("1", "30", 4, 150),
    ("3", "20", 1, 10),
    ("2", "30", 2, 60),
]


def write_100k(root):
    root.mkdir()
    (root / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
    (root / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n")
    flags = {"10": [0, 1, 1] + [0] * 16, "20": [0] * 8 + [1] + [0] * 10, "30": [0] * 19}
    (root / "u.item").write_bytes(
        "".join(
            f"{m}|Caf\xe9 ({m})|01-Jan-1995||http://x|" + "|".join(map(str, f)) + "\n"
            for m, f in flags.items()
        ).encode("latin-1")
    )


def write_1m(root):
    root.mkdir()
    (root / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in RATINGS))
    (root / "users.dat").write_text("1::F::1::10::48067\n3::M::56::16::70072\n")
    (root / "movies.dat").write_bytes(
        "10::Toy Story (1995)::Animation|Children's|Comedy\n20::Heat::Action\n"
        "30::Am\xe9lie::Romance\n".encode("latin-1")
    )


def write_20m(root):
    root.mkdir()
    lines = ["userId,movieId,rating,timestamp"] + [f"{u},{i},{r}.0,{t}" for u, i, r, t in RATINGS]
    (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    (root / "movies.csv").write_text(
        'movieId,title,genres\n10,"Toy Story, The (1995)",Animation|Comedy\n'
        "20,Heat (1995),(no genres listed)\n30,Up,Drama\n"
    )


def write_recbole(root):
    root.mkdir()
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    inter += [f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in RATINGS]
    (root / "ml.inter").write_text("\n".join(inter) + "\n")
    (root / "ml.user").write_text(
        "user_id:token\tage:token\theight:float\n1\t24\t1.8\n2\t53\t1.6\n"
    )
    (root / "ml.item").write_text(
        "item_id:token\tmovie_title:token_seq\tclass:token_seq\n"
        "10\tToy Story\tAnimation Comedy\n20\tHeat\tAction\n30\tUp\t\n"
    )


def batch_rows(data):
    b = next(data.batches(data.num_rows, shuffle=False))
    return {k: b.sparse_features[k] for k in data.keys}, b


@pytest.mark.parametrize(
    "writer, fmt",
    [
        (write_100k, "ml-100k"),
        (write_1m, "ml-1m"),
        (write_20m, "ml-20m"),
        (write_recbole, "recbole"),
    ],
)
def test_readers(tmp_path, writer, fmt):
    writer(tmp_path / fmt)
    data = load_movielens(tmp_path / fmt)
    assert data.format == fmt and data.num_dense == 0 and data.num_rows == 6
    feats, b = batch_rows(data)
    assert b.dense_features.shape == (6, 0)
    assert b.labels.tolist() == [float(r >= 4) for _, _, r, _ in RATINGS]
    # ids are contiguous, in sorted raw order
    assert feats["user_id"].values()[:6].tolist() == [0, 0, 1, 0, 2, 1]
    assert feats["item_id"].values()[:6].tolist() == [0, 1, 0, 2, 1, 2]
    assert data.num_embeddings_per_feature[:2] == [3, 3]
    genres_key = "class" if fmt == "recbole" else "genres"
    voc = data.vocab[genres_key]
    expected = {
        "ml-100k": {"10": ["Action", "Adventure"], "20": ["Drama"], "30": []},
        "ml-1m": {"10": ["Animation", "Children's", "Comedy"], "20": ["Action"], "30": ["Romance"]},
        "ml-20m": {"10": ["Animation", "Comedy"], "20": [], "30": ["Drama"]},
        "recbole": {"10": ["Animation", "Comedy"], "20": ["Action"], "30": []},
    }[fmt]
    bags = feats[genres_key].to_dense()
    for row, (_, item, _, _) in enumerate(RATINGS):
        assert sorted(bags[row]) == sorted(voc[g] for g in expected[item])
    assert 0 not in voc.values()  # id 0 is "unknown"
    if fmt in ("ml-100k", "ml-1m"):
        assert set(data.keys) == {"user_id", "item_id", "age", "gender", "occupation", "genres"}
        gender = feats["gender"].values()[:6].tolist()
        known = {"ml-100k": {"1": "M", "2": "F"}, "ml-1m": {"1": "F", "3": "M"}}[fmt]
        for row, (u, _, _, _) in enumerate(RATINGS):
            assert gender[row] == (data.vocab["gender"][known[u]] if u in known else 0)
    if fmt == "recbole":  # float columns and titles are not features
        assert data.keys == ["user_id", "item_id", "age", "class"]


def test_threshold_and_malformed(tmp_path):
    write_100k(tmp_path / "a")
    data = load_movielens(tmp_path / "a", threshold=3)
    assert data.labels().tolist() == [float(r >= 3) for _, _, r, _ in RATINGS]
    with open(tmp_path / "a" / "u.data", "a") as f:
        f.write("7\t8\n")
    with pytest.raises(ValueError, match=r"u.data:7: expected 4 fields"):
        load_movielens(tmp_path / "a")
    write_recbole(tmp_path / "r")
    (tmp_path / "r" / "ml.user").write_text("user_id\tage:token\n1\t2\n")
    with pytest.raises(ValueError, match=r"ml.user:1: header field 'user_id' needs a type"):
        load_movielens(tmp_path / "r")
    with pytest.raises(FileNotFoundError, match="no MovieLens files"):
        (tmp_path / "empty").mkdir()
        load_movielens(tmp_path / "empty")


def test_time_split_holds_out_each_users_latest(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    rng = np.random.default_rng(0)
    rows = [
        (u, rng.integers(0, 50), rng.integers(1, 6), rng.integers(0, 10**6))
        for u in range(20)
        for _ in range(rng.integers(1, 15))
    ]
    (root / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    train, test = movielens_split(root, test_fraction=0.25)
    assert train.num_rows + test.num_rows == len(rows)
    assert train.num_embeddings_per_feature == test.num_embeddings_per_feature
    tr, _ = batch_rows(train)
    te, _ = batch_rows(test)
    users_tr = np.asarray(tr["user_id"].values()[: train.num_rows])
    users_te = np.asarray(te["user_id"].values()[: test.num_rows])
    by_user = {}
    for u, _, _, t in rows:
        by_user.setdefault(u, []).append(t)
    for u, times in by_user.items():
        uid = train.vocab["user_id"][str(u)]
        assert (users_te == uid).sum() == round(0.25 * len(times))
    # random split: deterministic from the seed
    a, _ = movielens_split(root, split="random", seed=1)
    b, _ = movielens_split(root, split="random", seed=1)
    c, _ = movielens_split(root, split="random", seed=2)
    assert a.num_rows == b.num_rows and np.array_equal(a.ratings, b.ratings)
    assert not (a.num_rows == c.num_rows and np.array_equal(a.ratings, c.ratings))
    with pytest.raises(ValueError, match="split must be"):
        movielens_split(root, split="user")
    assert len(users_tr) == train.num_rows


def fake_wheel(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("recbole/__init__.py", "")
        zf.writestr(
            "recbole/dataset_example/ml-100k/ml-100k.inter",
            "user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\t5\t9\n",
        )
        zf.writestr("recbole/dataset_example/ml-100k/ml-100k.user", "user_id:token\n1\n")
        zf.writestr("recbole/dataset_example/ml-100k/ml-100k.item", "item_id:token\n2\n")
        zf.writestr("recbole/dataset_example/ml-1m/ml-1m.inter", "x")
    return path


def test_extract_and_fetch_offline(tmp_path):
    out = extract_ml100k(fake_wheel(tmp_path / "recbole-1.2.1-py3-none-any.whl"), tmp_path / "c")
    assert sorted(p.name for p in out.iterdir()) == [
        "ml-100k.inter",
        "ml-100k.item",
        "ml-100k.user",
    ]
    assert load_movielens(out).num_rows == 1
    calls = []

    def download(dest):
        calls.append(dest)
        fake_wheel(f"{dest}/recbole-1.2.1-py3-none-any.whl")

    path = fetch_movielens_100k(tmp_path / "cache", download=download)
    assert path == tmp_path / "cache" / "ml-100k" and len(calls) == 1
    assert fetch_movielens_100k(tmp_path / "cache", download=download) == path
    assert len(calls) == 1  # idempotent: no second download
    with zipfile.ZipFile(tmp_path / "bad.whl", "w") as zf:
        zf.writestr("recbole/__init__.py", "")
    with pytest.raises(ValueError, match="has no recbole/dataset_example/ml-100k/"):
        extract_ml100k(tmp_path / "bad.whl", tmp_path / "c2")
