class InputMixin:
    pass
