"""freetoken_patch"""
