"""gdn_packed inside other frameworks' models. Each integration imports its framework only when it is
used, so `import gdn_packed.integrations.<name>` works without the framework installed.

    gdn_packed.integrations.transformers   HF transformers' Qwen3-Next / Qwen3.5 / Qwen3.5-MoE:
                                           apply(model) or `with patch(model):`, padding-free training
                                           and generation that keep packed documents apart
"""
