"""Attribution-quality benchmark: dattri LDS / LOO protocol, regenerated offline."""
