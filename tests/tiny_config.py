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

# The network regime of the linear-scaling HPO at tiny size (tests/hpo, tests/ground/distributed).
TINY_HPO = {
    "regime": "network",
    "upstreams": ["scratch"],
    "tasks": ["syn-shift"],
    "algorithms": ["dpsgd"],
    "seeds": [0],
    "target_epsilon": 1.2,
    "sweep_epsilons": [0.2, 0.3],
    "trials_per_sweep": 2,
    "lr_range": [0.05, 1.0],
    "steps_range": [4, 5],  # few distinct T: each (epsilon, T) costs a sigma calibration
    "grid_size": 3,
    "selection": "exponential",
    "selection_epsilon": 0.1,
}
