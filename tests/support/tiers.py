"""The settings of an appliance serving the demo model in two tiers, `full` (two replicas) and
`fast` (one, a smaller context): the tiers test's and bench/serving_tiers.py's."""

TWO_TIERS = """
[[pools]]
name = "full"
served_model_name = "assistant"
tier = "full"
replicas = 2

[[pools]]
name = "fast"
served_model_name = "assistant"
tier = "fast"
max_model_len = 1024
"""
