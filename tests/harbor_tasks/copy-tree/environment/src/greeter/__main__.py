from greeter import NAME
print(f'hello, {NAME}')
