class StateMixin:
    pass
