"""moe_offload"""
