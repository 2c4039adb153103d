"""rimuru"""
