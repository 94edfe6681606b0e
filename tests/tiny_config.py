"""The tiny synthetic config the tests share (importable, unlike conftest)."""

TINY_RAW = {
    "seed": 0,
    "results_dir": "results",
    "data": {"root": "data", "download": False, "split_seed": 0},
    "public": {
        "dataset": "synthetic",
        "classes": [0, 1, 2, 3, 4],
        "n_train": 1000,
        "n_val": 0,
        "n_test": 200,
    },
    "tasks": {
        "syn-same": {
            "dataset": "synthetic",
            "classes": [0, 1, 2, 3, 4],
            "n_train": 300,
            "n_val": 100,
            "n_test": 200,
        },
        "syn-shift": {
            "dataset": "synthetic",
            "classes": [5, 6, 7, 8, 9],
            "n_train": 400,
            "n_val": 100,
            "n_test": 300,
        },
    },
    "model": {"name": "cnn-gn", "groups": 4, "width": 8},
    "warmup": {
        "epochs": 1,
        "batch_size": 64,
        "lr": 0.05,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "milestones": [],
        "lr_gamma": 0.1,
    },
    "pretrain": {"methods": ["scratch", "standard"]},
    "finetune": {
        "algorithms": ["dpsgd"],
        "epsilons": [1, 4],
        "seeds": [0],
        "batch_size": 50,
        "epochs": 2,
        "lr": 0.5,
        "momentum": 0.0,
        "max_grad_norm": 1.0,
    },
    "privacy": {"delta": 1e-5, "accountant": "prv"},
    "robustness": {"noise_std": 0.05, "draws": 2, "seed": 1234},
    "tracking": {"experiment": "tests"},
}
