"""rimuru/memory"""
