NAME = 'greeter'
