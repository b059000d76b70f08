"""The command line: `meshtrain train | export | sample | import-hf | prepare | tokenizer | plan |
doctor`, its parsers, and `train --layout` through the planner.
"""
