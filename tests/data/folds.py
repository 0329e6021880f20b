"""The k-fold check every datamodule with `folds` passes (its tests live with each example's data)."""


def check_folds(make, ids, test_ids, k=3):
    """The datamodule `make(folds, fold)` makes: each of its k folds' train and val sets (samples named by
    `ids(dataset)`) are disjoint and together hold the plain datamodule's train + val (`ids(None)`), each sample
    validates in exactly one fold, and the test set is the plain one (`test_ids`). Returns the set-up folds."""
    plain = make(None, 0)
    plain.setup()
    pool = sorted(ids(plain))
    folds = [make(k, n) for n in range(k)]
    for dm in folds:
        dm.setup()
        train, val = ids(dm.train_set), ids(dm.val_set)
        assert not set(train) & set(val) and sorted(train + val) == pool
        assert test_ids(dm.test_set) == test_ids(plain.test_set)
    assert sorted(i for dm in folds for i in ids(dm.val_set)) == pool  # each sample in one fold's val
    return folds
