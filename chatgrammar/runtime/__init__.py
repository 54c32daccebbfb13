"""What runs per sample: lexers, the LALR driver (parse), spans and policies, the memoised fast
path and its optional C accelerator, tokenizer adapters, Format.
"""
